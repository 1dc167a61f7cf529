"""The node keeper (memory daemon): the shared-memory snapshot slots of a node's ranks
(``shm``), the daemon that owns them and serves them over TCP (``daemon``, ``wire``), its
write fence and the leased ``keepers/<node>`` report it publishes to etcd.
"""

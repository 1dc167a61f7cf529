"""The services a job needs and owns: the embedded etcd, the local Ray cluster, the c10d
TCPStore, and the launcher's view of etcd being unreachable.
"""

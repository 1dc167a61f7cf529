"""Everything inside a training process and a node: the session a loop uses, snapshots,
the node keeper, replication, tiers, the etcd membership adapter and the transport.
Never imports Ray."""

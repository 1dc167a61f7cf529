"""Copies of snapshots on other nodes: where they go (``placement``, pure), the push from
the owning keeper (``pusher``) and the receiving side (``receiver``) over their wire
protocol, and the global commit point that replication makes possible (``commit``).
"""

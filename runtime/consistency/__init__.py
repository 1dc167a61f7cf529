"""Silent-corruption checks across data-parallel replicas: digests of a rank's replicated
state, one rank's side of the cross-rank comparison, and repair from a healthy peer.
(Not to be confused with ``runtime.replication``, the copies of snapshots on other nodes.)
"""

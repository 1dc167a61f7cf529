"""Snapshots of one rank's training state: flattening registered objects into named tensors
plus a JSON tree (``state_tree``), the byte format (``format``), per-tensor checksums and
the native fused copy, the per-step capture into keeper memory (``snapshotter``), and the
restore ladder that reads a snapshot back from the best source (``restore``).
"""

"""``torch.distributed.checkpoint`` on phalanx tiers: the storage writer/reader a user's
``dcp.save``/``dcp.load`` calls and the JSON (never pickle) form of DCP's metadata.
"""

"""Persistent checkpoint tiers (local disk, S3) behind the ``Tier`` port, the specs a
config names, which step each tier persists (``cadence``), and the keeper's background
persister.
"""

"""In-memory fakes of phalanx's ports for unit tests. Each passes the same contract suite
as the real adapter (``tests/contract``).
"""

"""Authenticated TCP messages between workers, keepers and peers: the frame format and
the threaded server and client.
"""

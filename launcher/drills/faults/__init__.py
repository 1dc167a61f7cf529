"""The fault mechanisms a drill fires, one module per family: process signals, storage
bytes, network links and partitions, services (etcd), capacity and numerical faults.
"""

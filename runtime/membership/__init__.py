"""The control plane as the runtime sees it: the etcd adapter of the ``Membership`` port
(the only module that imports ``etcd3``) and generations, the fencing token workers and
keepers check.
"""

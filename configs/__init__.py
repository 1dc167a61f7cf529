"""The config: schema (frozen dataclasses), the strict YAML loader and overrides, the
error tree, and the shipped presets (``demo.yaml``, ``spares.yaml``, ``drills/*.yaml``).
Imports only the standard library and yaml."""

"""The Ray-managed warm spare pool."""
from phalanx.configs.environment import apply_ray_environment

apply_ray_environment()

"""The Ray-managed warm spare pool."""
from configs.environment import apply_ray_environment

apply_ray_environment()

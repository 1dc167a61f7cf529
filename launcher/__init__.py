"""CLI, composition root, embedded services, worker actors, drills and reports."""
from phalanx.configs.environment import apply_ray_environment

apply_ray_environment()

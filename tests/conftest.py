"""Shared test setup: 8 fake CPU devices for the jax tests, set before jax is imported."""

from jax_impl.mesh import ensure_host_devices

ensure_host_devices(8)

"""Evaluations, benchmarks and demos of tierattn (reasoning accuracy, fidelity, the key-tier
probe, kernel demo)."""

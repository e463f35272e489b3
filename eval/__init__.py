"""Evaluations, benchmarks and demos of tierattn (reasoning accuracy, fidelity, kernel demo)."""

"""Hugging Face integration (attention function, mask function, Cache subclass, patch/unpatch).

Empty until the HF integration issue lands; importing it has no side effects.
"""

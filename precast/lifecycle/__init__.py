"""Descriptors, the op base class, the artifact cache, launching, and the op classes."""

"""Helpers shared by test modules (test modules never import each other)."""

"""Batch API: built by the Batch API issue."""

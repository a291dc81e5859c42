"""Files API: built by the Files API issue."""

"""rollmatch."""

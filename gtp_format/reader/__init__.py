"""Reading a checkpoint folder: confined file access, allow-listed unpickling, the layout readers."""

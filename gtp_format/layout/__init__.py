"""Where every tensor of a checkpoint sits: parallel config, rank topology, shard specs, election."""

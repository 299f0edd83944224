"""An agent's durable half: workspaces on disk, recovery records, the state directory, and
reconciling them with what exists after a crash."""

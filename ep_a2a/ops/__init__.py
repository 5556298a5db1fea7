"""Framework-registered ops: each module imports its framework only when used."""

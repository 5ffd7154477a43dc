"""Role: Ray actors, router, launchers and job entrypoints."""

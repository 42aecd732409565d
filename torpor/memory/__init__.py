"""Memory beyond the working set: episodic and semantic items, reconciliation, the digest."""

"""Contract tests: one per Protocol, running every implementation, fakes included."""

"""The worker: claims jobs, runs handlers, keeps leases alive, writes outcomes."""

"""Engine adapters, one per engine. Each implements bench.backend.Backend."""

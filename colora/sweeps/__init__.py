"""Many runs: a sweep's plan and its record (sweep.json), run in processes grouped by MPS share, or
over a Ray cluster."""

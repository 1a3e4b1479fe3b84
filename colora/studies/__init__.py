"""Studies over runs: pre-registrations, statistics, reports and where a base model starts on a task."""

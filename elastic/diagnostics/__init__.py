"""Diagnostics: `elastic verify-resume` (diagnostics.verify), runs a job with chaos kills and checks that every
sample was trained exactly once."""

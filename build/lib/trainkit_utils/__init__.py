"""Small helpers every trainkit package uses: argument checks, atomic and durable file writes,
and the comparison of validation scores. Standard library and torch only; no trainkit package."""

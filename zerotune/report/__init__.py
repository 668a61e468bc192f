"""The answer: results files and the summary, live progress, the dry-run plan."""

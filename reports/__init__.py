"""Reports: quality and speed metrics rendered as self-contained HTML."""

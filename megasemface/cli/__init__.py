"""Command-line entry points; tools/ holds matching scripts."""

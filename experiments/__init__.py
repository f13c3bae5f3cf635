"""Command line, paper reproductions, cross-validation, plots and reports."""

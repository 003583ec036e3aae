"""Tools of the repository that are neither the package nor its benchmarks (mutation testing)."""

"""The definition's vocabulary: parameters, the step plan, the noise, shared checks and constants,
the order key and the +inf rule, output types and errors. Imports nothing else of the package."""

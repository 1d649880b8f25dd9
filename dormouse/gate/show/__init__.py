"""The gate's presentation: the verdict as text and verdict.json, tables and
plots. It reads Verdicts and artifacts; it never runs anything."""

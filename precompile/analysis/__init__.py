"""What an exported graph says: ``shapes`` (the symbol of each input axis, the tables that bound a
dim, the guards torch added, the ops without a kernel) and ``value_ranges`` (the tables integer
inputs index, hence the values the loader accepts)."""

"""What verification owns: draft trees (`Draft`), their layout and attention masks, the ways to
grow them, and the acceptance rules. Drafters and strategies both import from here."""

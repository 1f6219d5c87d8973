"""Tools for people working on ddpdoctor itself (not used by the `ddpdoctor` command)."""

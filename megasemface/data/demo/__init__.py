"""The demo corpus: real sentence pairs from the gettext catalogs installed on a system."""

"""rewind.stores."""

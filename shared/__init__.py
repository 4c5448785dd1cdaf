"""Code both sides of tokenq need: keys, wire format, settings, errors, the packer."""

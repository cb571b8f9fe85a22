package ratelimit

// A client address in a key stands for its network (internal/clientaddr):
// ipv4_prefix and ipv6_prefix, of a policy or its handler, say how many of
// its leading bits a key keeps.

// checkPrefix checks a prefix length setting: 0 (the default) or 1 to all.
func checkPrefix(field string, bits, all int) error {
	if bits < 0 || bits > all {
		return fieldErr(field, "%s: %d must be from 1 to %d (the leading bits of a client address kept in keys)", field, bits, all)
	}
	return nil
}

package ratelimit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"sync"
)

// keyHasher turns a resolved identity (an API key, a user id, an IP) into
// the fixed-length token that stands for it in storage keys, so that no raw
// identity is ever stored, logged or sent to Redis.
type keyHasher struct {
	pool sync.Pool // of hash.Hash: HMAC-SHA-256 with the secret, or SHA-256
}

func newKeyHasher(secret string) *keyHasher {
	kh := new(keyHasher)
	kh.pool.New = func() any {
		if secret == "" {
			return sha256.New()
		}
		return hmac.New(sha256.New, []byte(secret))
	}
	return kh
}

// hashLen is the length in bytes of the hash kept in a key: 128 bits is
// ample against collisions. Written in unpadded base64url (22 characters,
// none of them a brace), a live key costs under 100 bytes of Redis memory.
const hashLen = 16

// sum returns the hash of identity, in unpadded base64url.
func (kh *keyHasher) sum(identity string) string {
	h := kh.pool.Get().(hash.Hash)
	h.Reset()
	h.Write([]byte(identity))
	var buf [sha256.Size]byte
	sum := h.Sum(buf[:0])
	kh.pool.Put(h)
	return base64.RawURLEncoding.EncodeToString(sum[:hashLen])
}

// storageKey is where the policy's bucket for one identity lives:
// <key_prefix><policy>:{<hash>}. The braces are a Redis Cluster hash tag, so
// all the policies of one identity live in one slot and one script call can
// decide them together.
func (p *Policy) storageKey(kh *keyHasher, identity string) string {
	return p.keyPrefix + "{" + kh.sum(identity) + "}"
}

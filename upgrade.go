package ratelimit

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Rolling upgrades. While a fleet runs two releases on one Redis, every
// instance must write what the older release reads correctly: this
// release writes v1 buckets (format.go), which the release before reads,
// until the fleet marker says every instance runs this release or a later
// one. The marker is a key, <key_prefix>format, holding "v2": an operator
// sets it once the last old instance is gone (`caddy rate-limit format
// v2`), and clears it before rolling back (`caddy rate-limit format v1`).
// Every instance reads it when it starts, every formatEvery, and at once
// when an instance announces a change on the events channel. Until it has
// read it, an instance writes v1: safe with any fleet.

// formatEvery is how often an instance reads the fleet marker.
const formatEvery = 10 * time.Second

// The marker's values.
const (
	markerV1 = "v1"
	markerV2 = "v2"
)

func formatMarker(prefix string) string { return prefix + "format" }

// storageFormat is a Redis connection's storage format: the one it writes
// buckets in (format.go), from the fleet markers of the key prefixes it
// serves, followed until the connection closes. It holds what it needs of
// the connection: the client, its name and logger, the bound of a call,
// the connection's end, and the prefixes it serves.
type storageFormat struct {
	client      redis.UniversalClient
	name        string
	logger      *zap.Logger
	callTimeout time.Duration
	closed      <-chan struct{}
	prefixes    func() []string
	// writes is the format buckets are written in; changed asks to read the
	// markers again.
	writes  atomic.Int32
	changed chan struct{}
}

// current is the format buckets are written in now.
func (f *storageFormat) current() int { return int(f.writes.Load()) }

// formatOf is the fleet's marker of the buckets under prefix, and the
// format this connection writes them in.
func (f *storageFormat) formatOf(ctx context.Context, prefix string) (marker, writes string, err error) {
	marker, err = f.client.Get(ctx, formatMarker(prefix)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return "", "", err
	}
	if marker != markerV2 {
		marker = markerV1
	}
	return marker, formatName(f.current()), nil
}

// followFormat reads the fleet markers every formatEvery until the
// connection closes.
func (f *storageFormat) followFormat() {
	t := time.NewTicker(formatEvery)
	defer t.Stop()
	for {
		f.readFormat()
		select {
		case <-t.C:
		case <-f.changed:
		case <-f.closed:
			return
		}
	}
}

// readFormat sets the format buckets are written in: v2 when the marker
// of every key prefix this connection serves says v2, v1 otherwise (and
// when the markers cannot be read).
func (f *storageFormat) readFormat() {
	ctx, cancel := context.WithTimeout(context.Background(), f.callTimeout)
	defer cancel()
	format := int32(formatV2)
	prefixes := f.prefixes()
	if len(prefixes) == 0 {
		format = formatV1
	}
	for _, prefix := range prefixes {
		v, err := f.client.Get(ctx, formatMarker(prefix)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			if errors.Is(err, redis.ErrClosed) {
				return // cleaned up first
			}
			f.logger.Debug("reading the fleet's storage format", zap.String("redis", f.name), zap.Error(err))
			return // keep what was known: a v1 fleet stays v1, a v2 one v2
		}
		if v != markerV2 {
			format = formatV1
		}
	}
	if old := f.writes.Swap(format); old != format {
		f.logger.Info("rate-limit buckets are written in format "+formatName(int(format)),
			zap.String("redis", f.name), zap.Int32("was", old))
	}
}

func formatName(format int) string {
	if format >= formatV2 {
		return markerV2
	}
	return markerV1
}

// setFormat sets the fleet marker of prefix, tells every instance, and
// writes in what the markers now say at once.
func (f *storageFormat) setFormat(ctx context.Context, prefix, marker string) error {
	var err error
	if marker == markerV2 {
		err = f.client.Set(ctx, formatMarker(prefix), markerV2, 0).Err()
	} else {
		err = f.client.Del(ctx, formatMarker(prefix)).Err()
	}
	if err != nil {
		return err
	}
	if err := f.client.Publish(ctx, eventsChannel(prefix), eventFormat+" "+prefix).Err(); err != nil {
		return err
	}
	f.readFormat() // this instance writes in what the markers say at once
	return nil
}

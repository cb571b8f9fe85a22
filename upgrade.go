package ratelimit

import (
	"context"
	"errors"
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

// followFormat reads the fleet markers every formatEvery until the
// connection closes.
func (c *redisStore) followFormat() {
	t := time.NewTicker(formatEvery)
	defer t.Stop()
	for {
		c.readFormat()
		select {
		case <-t.C:
		case <-c.formatChanged:
		case <-c.closed:
			return
		}
	}
}

// readFormat sets the format buckets are written in: v2 when the marker
// of every key prefix this connection serves says v2, v1 otherwise (and
// when the markers cannot be read).
func (c *redisStore) readFormat() {
	ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
	defer cancel()
	format := int32(formatV2)
	prefixes := c.events.prefixes()
	if len(prefixes) == 0 {
		format = formatV1
	}
	for _, prefix := range prefixes {
		v, err := c.client.Get(ctx, formatMarker(prefix)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			if errors.Is(err, redis.ErrClosed) {
				return // cleaned up first
			}
			c.logger.Debug("reading the fleet's storage format", zap.String("redis", c.name), zap.Error(err))
			return // keep what was known: a v1 fleet stays v1, a v2 one v2
		}
		if v != markerV2 {
			format = formatV1
		}
	}
	if old := c.format.Swap(format); old != format {
		c.logger.Info("rate-limit buckets are written in format "+formatName(int(format)),
			zap.String("redis", c.name), zap.Int32("was", old))
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
func (c *redisStore) setFormat(ctx context.Context, prefix, marker string) error {
	var err error
	if marker == markerV2 {
		err = c.client.Set(ctx, formatMarker(prefix), markerV2, 0).Err()
	} else {
		err = c.client.Del(ctx, formatMarker(prefix)).Err()
	}
	if err != nil {
		return err
	}
	if err := c.client.Publish(ctx, eventsChannel(prefix), eventFormat+" "+prefix).Err(); err != nil {
		return err
	}
	c.readFormat() // this instance writes in what the markers say at once
	return nil
}

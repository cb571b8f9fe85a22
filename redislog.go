package ratelimit

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// go-redis logs what goes wrong inside it (a failed dial, a connection
// with unread data) as plain text on stderr, dozens of lines a second
// while Redis is down, which breaks a structured log. Its lines go
// through the module's zap logger instead: at DEBUG, since the module
// reports the same failures itself (redisStore.report, the circuit
// breaker's WARN), except a recovered panic, at ERROR; and each kind of
// line at most once per reportInterval, with how many were dropped. The
// logger go-redis uses is the process's, so this covers every module of
// the binary that uses go-redis.

func init() { redis.SetLogger(&goRedisLog) }

var goRedisLog goRedisLogger

// goRedisLogger is go-redis's logger: the last provisioned handler's
// logger, or Caddy's default before one is.
type goRedisLogger struct {
	logger atomic.Pointer[zap.Logger]

	mu   sync.Mutex
	seen map[string]*goRedisLine // by format
}

// goRedisLine is when a kind of line was last logged, and how many of it
// were dropped since.
type goRedisLine struct {
	at      time.Time
	dropped int
}

// maxGoRedisFormats bounds what goRedisLogger remembers: go-redis's
// formats are constants, well under it.
const maxGoRedisFormats = 256

// use makes logger, named go-redis, the one go-redis's lines go through.
func (l *goRedisLogger) use(logger *zap.Logger) { l.logger.Store(logger.Named("go-redis")) }

// Printf is go-redis's internal.Logging.
func (l *goRedisLogger) Printf(_ context.Context, format string, v ...any) {
	logger := l.logger.Load()
	if logger == nil {
		logger = caddy.Log().Named("http.handlers.rate_limit.go-redis")
	}
	level := zapcore.DebugLevel
	if strings.Contains(format, "panic") {
		level = zapcore.ErrorLevel
	}
	if !logger.Core().Enabled(level) {
		return
	}
	dropped, ok := l.admit(format, time.Now())
	if !ok {
		return
	}
	msg := strings.TrimPrefix(strings.TrimSpace(fmt.Sprintf(format, v...)), "redis: ")
	fields := []zap.Field{zap.String("source", "go-redis")}
	if dropped > 0 {
		fields = append(fields, zap.Int("dropped_since_last", dropped))
	}
	logger.Log(level, msg, fields...)
}

// admit reports whether a line of format may be logged now, and how many
// of its kind were dropped since the last one logged.
func (l *goRedisLogger) admit(format string, now time.Time) (dropped int, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil || len(l.seen) >= maxGoRedisFormats {
		l.seen = map[string]*goRedisLine{}
	}
	line := l.seen[format]
	if line == nil {
		l.seen[format] = &goRedisLine{at: now}
		return 0, true
	}
	if now.Sub(line.at) < reportInterval {
		line.dropped++
		return 0, false
	}
	dropped, line.at, line.dropped = line.dropped, now, 0
	return dropped, true
}

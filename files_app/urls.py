from rest_framework.routers import SimpleRouter

from files_app.views import FileViewSet

router = SimpleRouter(trailing_slash=False)
router.register("v1/files", FileViewSet, basename="file")
urlpatterns = router.urls
